"""`python -m server serve ...` is the same as `specserve serve ...`."""

from server.cli import main

main()
