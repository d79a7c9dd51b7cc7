"""`python -m tandem ...` is the `tandem` command."""
from tandem.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
