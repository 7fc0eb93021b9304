"""Small helpers with no knowledge of models: files (checked folders, atomic writes, hashes)
and progress bars."""
