import sys

from shardmoe.cli import main

sys.exit(main())
