"""The model-facing layer (execpool/agent/): the tool layer and the tool-calling loop."""
