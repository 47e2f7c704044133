#!/usr/bin/env python
"""Thin wrapper over the `fxmem-plan` command (fxmem/cli/main.py), runnable from a checkout."""
import sys

from fxmem.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
