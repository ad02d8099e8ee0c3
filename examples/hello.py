"""A small tool run: lines arrive live, one every 0.2 s, then a summary."""
import os
import sys
import time

for step in range(1, 6):
    print(f"step {step}/5: working in {os.getcwd()}")
    time.sleep(0.2)
print("secrets visible to the tool:", sorted(k for k in os.environ if "KEY" in k or "TOKEN" in k) or "none")
print(f"done with Python {sys.version.split()[0]}")
