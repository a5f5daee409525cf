"""Test engines: recorded response shapes of several engine versions, and a server that replays them."""
