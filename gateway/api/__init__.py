"""The gateway's HTTP surface: OpenAI request/response models and routes, tools, formats, logprobs, stops, the
Responses API, tokenize, model cards, and the admin and internal APIs with their auth."""
