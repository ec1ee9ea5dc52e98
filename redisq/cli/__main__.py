import sys

from redisq.cli import main

sys.exit(main())
