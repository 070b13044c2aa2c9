"""The reference in plain PyTorch: the quantizer (``quantizer``) and pack/unpack (``reference``)."""
