#!/usr/bin/env python
"""Thin wrapper over the `fxmem-plan` command (fxmem/cli.py), runnable from a checkout."""
import sys

from fxmem.cli import main

if __name__ == "__main__":
    sys.exit(main())
