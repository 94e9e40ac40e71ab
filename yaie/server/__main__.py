"""``python -m yaie.server`` is ``yaie serve``."""

import sys

from yaie.device import prepare_triton

prepare_triton()

from yaie.server.cli import main  # noqa: E402

sys.exit(main())
