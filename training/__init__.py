"""Training of draft heads (EAGLE): not part of the serving runtime; imported only by
`specserve train-draft` (server/cli.py) and its tests."""
