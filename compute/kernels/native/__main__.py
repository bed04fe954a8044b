import sys

from compute.kernels.native import main

sys.exit(main())
