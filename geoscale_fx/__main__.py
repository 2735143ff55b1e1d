import sys

from geoscale_fx.cli import main

sys.exit(main())
