"""manyeyes' web service: a FastAPI app serving attention from the model core."""
