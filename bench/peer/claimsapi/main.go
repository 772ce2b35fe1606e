// Command claimsapi answers the one API call the bench's peer driver makes: GET of a
// resource.k8s.io/v1 ResourceClaim. It serves the claims from the same directory the agent reads
// offline (DIR/resourceclaims/<namespace>/<name>.yaml), as JSON, like an API server answers
// client-go; a file's JSON is kept while its inode, mtime and size stay the same (the agent's
// directory source keeps its parsed claims the same way).
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"sigs.k8s.io/yaml"
)

type fileKey struct {
	ino, mtime, size int64
}

type cached struct {
	key  fileKey
	body []byte
}

type server struct {
	root  string
	mu    sync.Mutex
	cache map[string]cached
}

func (s *server) claim(w http.ResponseWriter, r *http.Request) {
	namespace, name := r.PathValue("namespace"), r.PathValue("name")
	if strings.ContainsAny(namespace+name, "/\x00") || namespace == ".." || name == ".." {
		status(w, http.StatusBadRequest, "BadRequest", "invalid namespace or name")
		return
	}
	body, err := s.read(filepath.Join(s.root, namespace, name+".yaml"))
	if errors.Is(err, fs.ErrNotExist) {
		status(w, http.StatusNotFound, "NotFound",
			fmt.Sprintf("resourceclaims.resource.k8s.io %q not found", name))
		return
	}
	if err != nil {
		status(w, http.StatusInternalServerError, "InternalError", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

func (s *server) read(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return nil, err
	}
	st := info.Sys().(*syscall.Stat_t)
	key := fileKey{ino: int64(st.Ino), mtime: info.ModTime().UnixNano(), size: info.Size()}
	s.mu.Lock()
	hit, ok := s.cache[path]
	s.mu.Unlock()
	if ok && hit.key == key {
		return hit.body, nil
	}
	text := make([]byte, info.Size())
	if _, err := f.ReadAt(text, 0); err != nil {
		return nil, err
	}
	body, err := yaml.YAMLToJSON(text)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	s.mu.Lock()
	s.cache[path] = cached{key: key, body: body}
	s.mu.Unlock()
	return body, nil
}

func status(w http.ResponseWriter, code int, reason, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"kind": "Status", "apiVersion": "v1", "status": "Failure",
		"message": message, "reason": reason, "code": code,
	})
}

func main() {
	dir := flag.String("dir", "", "the offline directory: claims under DIR/resourceclaims/<namespace>/<name>.yaml")
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "--dir is required")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "claims API:", err)
		os.Exit(1)
	}
	s := &server{root: filepath.Join(*dir, "resourceclaims"), cache: map[string]cached{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}", s.claim)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		status(w, http.StatusNotFound, "NotFound", "the bench's claims API serves only resource.k8s.io/v1 ResourceClaims")
	})
	// The address, for the bench to hand to the peer driver.
	fmt.Printf("http://%s\n", ln.Addr())
	if err := http.Serve(ln, mux); err != nil {
		fmt.Fprintln(os.Stderr, "claims API:", err)
		os.Exit(1)
	}
}
