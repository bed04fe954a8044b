"""The engine: requests in, tokens out (scheduler, block manager, sequences, runner, sampling, grammar, stream, stops)."""
