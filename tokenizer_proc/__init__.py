"""Front door: ZMQ ROUTER and HTTP, tokenize/detokenize, chat template, the LoRA registry."""
