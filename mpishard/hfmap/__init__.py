"""What a model's Hugging Face name map is built from, below models/ (hf/, above, reads and
writes the directories through the maps):

  fields.py   config.json fields read strictly, an absent one as transformers' default
  views.py    region_of (the one reading of an index into a lazily read array) and the
              name-map entries assembled from several file tensors (Stacked, Fused)

Each architecture's map lives in its folder (models/gpt/hf.py, models/llama/hf.py, ...);
models/interface.py says what a map holds and how a spec hands it out.
"""
