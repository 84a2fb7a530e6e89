"""What the tests share: an assembled relay, real servers, drivers."""
