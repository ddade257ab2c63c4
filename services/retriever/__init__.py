"""The retriever service: documents into Milvus chunks, similarity search, and the semantic cache."""
