"""What the scheduler and the workers share: generated gRPC code, model-directory helpers, logging."""
