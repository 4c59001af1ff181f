"""totalrun: start N local workers and supervise them (see ``cli.py`` for the manual)."""
