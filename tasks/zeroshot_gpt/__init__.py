"""Zero-shot evaluation of a GPT checkpoint: WikiText-103-style perplexity and LAMBADA."""
