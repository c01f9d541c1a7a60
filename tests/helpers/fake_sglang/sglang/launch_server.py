import time

time.sleep(3600)  # loading, as far as anyone can tell
