"""``python -m moonplan.cli ...``: the ``moonplan`` command."""

import sys

from moonplan.cli.main import main

sys.exit(main())
