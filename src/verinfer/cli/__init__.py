"""The command line: a thin layer over the public API (``verinfer.api``) with one vocabulary of
options (``verinfer.cli.options``). ``verinfer.cli.main.app`` is the console entry point."""
