"""What a run reads: its training data (`data`: token files, synthetic batches, and `sources`, the run's data opened
as its settings say), and text with its tokenizer, tokenized once into a token file (`text`, which also says what a
token file is)."""
