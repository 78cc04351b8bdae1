"""``python -m apmodel.cli``: the ``apmodel`` command."""

from apmodel.cli import main

main()
