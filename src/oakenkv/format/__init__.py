"""The bytes: the method's parameters (``config``) and the row and page-record layout (``layout``)."""
