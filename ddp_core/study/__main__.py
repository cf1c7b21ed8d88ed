import sys

from ddp_core.study import main

sys.exit(main())
