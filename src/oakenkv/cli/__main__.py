"""``python -m oakenkv.cli``: the ``oakenkv`` command."""

from oakenkv.cli import main

main()
