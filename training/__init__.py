"""Training of draft heads (EAGLE): not part of the serving runtime; imported only by
`specserve train-draft` (training/cli.py) and its tests."""
