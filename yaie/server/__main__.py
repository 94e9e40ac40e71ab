"""``python -m yaie.server`` is ``yaie serve``."""

import sys

if __name__ == "__main__":     # not when the engine process (spawned) imports this module again
    from yaie.device import prepare_triton

    prepare_triton()
    from yaie.server.cli import main

    sys.exit(main())
