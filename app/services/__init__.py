"""The service layer between the HTTP routes and model/: registry, batcher, cache, payload encoding."""
