"""The global manager: performance model, placement policy, leader election."""
