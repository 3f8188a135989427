"""Subcommands of the ``posttrain`` CLI, one module each."""
