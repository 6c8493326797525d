"""Training the embedded student on the teacher's responses (OverFill's recipe; :mod:`kvlab.train.trainer`) and
loading the pair (:mod:`kvlab.train.pair`: ``load_pair``, ``load_student``). May write: trained weights, cached
teacher responses and checkpoints under the kvlab cache dir (``$KVLAB_CACHE``), never the run store."""
