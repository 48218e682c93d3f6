"""What the tests share: processes, reference models, fake workers, certificates."""
