"""``python -m oakenkv.cli``: the ``oakenkv`` command."""

from oakenkv.cli import main

if __name__ == "__main__":
    main()
