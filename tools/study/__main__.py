import sys

from tools.study import main

sys.exit(main())
