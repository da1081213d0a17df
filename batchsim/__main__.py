"""``python -m batchsim``: the same as the ``batchsim`` command."""

import sys

from .cli import main

sys.exit(main())
