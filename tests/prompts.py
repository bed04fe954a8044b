"""Fixed chat prompts shared by the real-model tests."""

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Romeo and Juliet?", "Give me a tip for learning Python."]  # fmt: skip
