import sys

from hypnos_cli.main import main

sys.exit(main())
