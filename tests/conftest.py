import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import env` works from anywhere
