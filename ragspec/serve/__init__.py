"""`ragspec serve`: the OpenAI-compatible server and its web page."""
