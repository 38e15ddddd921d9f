"""Engine logic with no torch import: requests, block pool, scheduler, detokenizer, engine loop."""
