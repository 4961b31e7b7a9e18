"""specdec: speculative decoding for LLM serving, split into gRPC microservices."""
