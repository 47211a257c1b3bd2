"""`python -m broker` is the `hyperkafka` command."""

import sys

from broker.cli import main

sys.exit(main())
