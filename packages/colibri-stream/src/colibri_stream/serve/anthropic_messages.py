"""stub"""

def answer(ctx, body):
    raise NotImplementedError
