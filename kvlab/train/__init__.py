"""Training the embedded student on the teacher's responses (OverFill's recipe); see :mod:`kvlab.train.trainer`."""
