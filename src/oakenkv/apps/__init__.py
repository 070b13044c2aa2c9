"""What the commands run, as library functions: ``demo``, ``generate`` (with ``timed_generate``), ``diagnose``,
``info``. The command line (``oakenkv.cli``) parses arguments and calls these."""
