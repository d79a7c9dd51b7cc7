"""The frontend process: clients in, tokenize and validate, outputs routed back."""
