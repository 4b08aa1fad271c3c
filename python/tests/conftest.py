import os
import sys

# The package from this checkout, installed or not.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
