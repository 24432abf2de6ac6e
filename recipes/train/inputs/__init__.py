"""What a run reads: its training data (`data`: token files, synthetic batches), text and its tokenizer (`text`),
and what a token file is (`token_file`)."""
