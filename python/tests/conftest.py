import os
import sys

# examples/python holds the encoder-parallel step the tests and examples share.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
